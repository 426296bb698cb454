"""The inf2 path rehearsed on a cpu (notebooks 04, 05, ``make rehearse``): NxD stand-ins, an
emulated SDK under ``sdk_path/`` (importable only where ``make rehearse`` puts it), the TP=2
emulation, the XLA lowering and the runbook run against them. It imports ``gemma_nb.neuron``; never
the other way round."""
