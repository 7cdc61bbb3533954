"""``python -m polyparallel`` == the ``polyparallel`` command."""

from polyparallel.cli import main

main()
