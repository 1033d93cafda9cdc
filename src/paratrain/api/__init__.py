"""The Python API for your own training loop (docs/own-loop.md): `paratrain.init(...)` returns the
handle (handle.py) whose setup, backward, save and load put a strategy around your model;
loader.py shares each global batch over the ranks; script.py runs a script under
`paratrain launch`."""
