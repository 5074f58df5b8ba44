"""Draft heads: configuration, EAGLE-1/2 and EAGLE-3 modeling, on-disk formats and export (official,
speculators), Hub publishing, model cards and calibration. Builds on `engine` (stats) and `kernels`."""
