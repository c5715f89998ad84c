"""Training backends: `torch` (CPU / small GPU, transformers models). Each implements the
`TrainingBackend` protocol in `base`; the trainer selects one with ``trainer.backend``."""
