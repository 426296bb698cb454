"""gemma-nb: the Gemma-4-26B-A4B on inf2.xlarge story, as code the notebooks import (the README maps notebooks to modules)."""

__version__ = "0.1.0"

import warnings as _warnings

# tqdm.auto (imported by transformers) warns when ipywidgets is absent, printing an absolute
# site-packages path on stderr: noise in every notebook and a machine-specific nbval output.
_warnings.filterwarnings("ignore", message="IProgress not found")
