"""What the command-line tools share: a parser described by its module's docstring, taking an
artifacts directory."""

from __future__ import annotations

import argparse


def doc_parser(prog: str, doc: str, artifacts: bool = True) -> argparse.ArgumentParser:
    """The parser of `prog`: `doc`'s first paragraph as its description, the rest as its epilog
    (kept as written), and (`artifacts`) the artifacts directory as its first argument."""
    head, _, rest = doc.partition("\n\n")
    p = argparse.ArgumentParser(
        prog=prog,
        description=head,
        epilog=rest,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if artifacts:
        p.add_argument("artifacts", help="artifacts directory written by dflash-export")
    return p
