"""Whole train steps (LeNet, ResNet20) against BatchNorm and PyTorch."""
