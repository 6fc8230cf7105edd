"""The generation loop, written once for every backend (loop.py, torch-free), what composes it (the backend
registry and `Generator`, beam search) and token choice on the host (NumPy) and inside graphs (torch).
Backends stand on loop.py and sampling.py; the registry reaches the backends only by name, when one is built."""
