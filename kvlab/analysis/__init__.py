"""Analysis helpers: reference measurements (Hugging Face baselines), memory, reports."""
