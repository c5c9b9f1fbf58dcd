"""nanoserve: serve and train small GPT models. Three layers, one direction:
`nanoserve.server` -> `nanoserve.engine` -> `nanoserve.model`."""
