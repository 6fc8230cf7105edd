"""The command line and the terminal: the parser (main.py), one module a command, the console's tables and
progress, the demo. The top floor: it may import every other room; none imports it. Parsing imports no torch,
so `staticrt --help` and an ONNX deployment's `staticrt run` start without it."""
