"""What a decode layer and the orchestrator agree on: the model config, one validated case, the
tensors a rank holds, the checks its outputs are judged by, the rank context an implementation
runs with, and the `Layer` interface. No math, no collectives."""
