"""The `inferbus` command line: run a local stack (`up`, `down`, `status`),
manage models in the registry (`models ...`) and send requests (`infer`)."""
