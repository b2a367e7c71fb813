"""`dflash-bench`: measure (run.py, peers.py), summarise (stats.py), render
(report.py with the prose in report.md.tmpl); cli.py is the command."""
