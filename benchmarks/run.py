"""Run the colobus benchmarks: ``python benchmarks/run.py [NAME] [--json [PATH]] [--quick]``."""

import sys

from colobus._tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
