"""Compile time: tracing, lowering and XLA seconds of the train programs."""
