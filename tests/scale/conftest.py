"""tests/scale/: multi-rank and multi-node runs of the stages (gloo ranks on CPU) and real-scale rehearsals.
Minutes each, so not collected by `make test`; `make test-scale` runs them and `.ci/run` calls it."""
