"""Training EAGLE heads: data (ShareGPT), feature extraction / self-distillation, loss, training loop."""
