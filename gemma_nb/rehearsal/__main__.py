"""``python -m gemma_nb.rehearsal``: the runbook rehearsed against the emulated SDK (``make
rehearse``)."""

import sys

from gemma_nb.rehearsal.rehearse import main

if __name__ == "__main__":
    sys.exit(main())
