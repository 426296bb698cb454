"""The inf2 port on the Neuron SDK 2.31 (notebooks 02-07): compile, artifact, deploy; the SDK
imported only when called. ``gemma_nb.rehearsal`` runs it on a cpu against an emulated SDK and is
never imported from here."""
