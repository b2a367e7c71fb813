"""The artifacts directory (docs/DESIGN.md, Artifacts): what an export writes and the runtime
reads.

    manifest.py     the typed manifest (programs, QPC records, file records, the shape plan);
                    read, validated and checked on load
    files.py        file helpers: atomic JSON, paths kept inside, sha256 and the cache of
                    checked files
    transaction.py  an artifacts directory written as one transaction (lock, staging, swap)
    preflight.py    the export's checks before heavy work, its shape plan and reuse key
    programs.py     both programs exported into a staging directory, described as a manifest
    build.py        export (or reuse), compile, record, write: `build_artifacts`,
                    `compile_artifacts`

Loading artifacts for the runtime imports manifest.py and files.py only (not the export or
compile stages); build.py and programs.py import the stages below them.
"""
