"""Code the tests share: references, data, processes, import graphs.

Imported as ``from tests.helpers import reference`` or
``from tests.helpers.selection import data``; nothing here is a test.
"""
