"""Evaluation: datasets read from ../shared/data and teacher-forced perplexity."""
