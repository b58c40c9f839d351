"""The convolutions on a CPU (`convolution`) and the C++ kernels behind them
(``csrc/``), compiled on first use (`build`)."""
