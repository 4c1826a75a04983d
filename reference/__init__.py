"""Readable single-device reference implementations, one folder per family. Never imports optimized/."""
