"""gemma-nb: the Gemma-4-26B-A4B on inf2.xlarge story, as code the notebooks import (the README maps
notebooks to modules)."""

__version__ = "0.1.0"

import warnings as _warnings

# tqdm.auto (via transformers) warns without ipywidgets, naming this machine's site-packages in
# nbval's output.
_warnings.filterwarnings("ignore", message="IProgress not found")
