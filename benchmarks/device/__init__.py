"""The prepared accelerator run (``device_check.sh``) and its own checks."""
