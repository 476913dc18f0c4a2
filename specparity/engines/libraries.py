"""How the libraries the engines load (transformers, tokenizers, huggingface_hub) behave in a gate run.

The gate's faces (``specparity run`` / ``sweep``, the pytest plugin) own their process, so they set
this once before any engine loads. Never download: every model is a local directory. No tokenizer
fork warnings, no model-loading progress bars (the command draws its own, or none). And, unless the
run is verbose, none of the libraries' warnings and log lines: on real tokenizers transformers
prints notes such as "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer" into every
run, which say nothing about the engine under test and bury the gate's own lines. A variable the
user set is kept (``TRANSFORMERS_VERBOSITY=info`` brings them back too).
"""

from __future__ import annotations

import os
import sys

#: Set (unless already set) in every gate run.
ALWAYS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
          "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
#: Set (unless already set) when the run is not verbose: errors only.
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_VERBOSITY": "error"}


def configure_libraries(verbose: bool = False) -> None:
    """Apply :data:`ALWAYS` and, unless ``verbose``, :data:`QUIET` to the environment, and to the
    libraries already imported (they read these variables when they are first imported)."""
    for key, value in {**ALWAYS, **({} if verbose else QUIET)}.items():
        os.environ.setdefault(key, value)
    for module, variable in (("transformers", "TRANSFORMERS_VERBOSITY"), ("huggingface_hub", "HF_HUB_VERBOSITY")):
        lib = sys.modules.get(module)
        if lib is None:
            continue
        logs = lib.utils.logging
        if module == "transformers":
            logs.disable_progress_bar()
        level = logs.log_levels.get(os.environ.get(variable, "").lower())
        if level is not None:
            logs.set_verbosity(level)
