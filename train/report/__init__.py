"""Reading finished runs: the report (`cli`, ``python -m train.report``) with
its runs, tables, figures and gain tables, and the plots (`plot`,
``python -m train.plot``) with their labels. numpy and matplotlib only."""
