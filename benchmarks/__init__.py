"""Benchmarks, run as modules: ``python -m benchmarks.<package>.<module>``.

``timing`` is what they share (interleaved median timing, the machine, the
JSON); ``layer`` times one normalization layer and the selection methods under
it; ``step`` times whole train steps; ``compile`` times compiling them;
``device`` is the prepared accelerator run and the checks only it makes.
"""
