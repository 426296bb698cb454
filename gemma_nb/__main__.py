"""``python -m gemma_nb``: the command line (``gemma_nb.cli``)."""

import sys

from gemma_nb.cli import main

if __name__ == "__main__":
    sys.exit(main())
