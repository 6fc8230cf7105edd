"""The artifact format: the manifest and its hash-checked, torch-free reader (manifest.py) and the atomic
folder writer (write.py). What goes into an artifact is the exporters' business."""
