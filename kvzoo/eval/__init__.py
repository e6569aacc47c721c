"""Evaluation any strategy can be put through: datasets read from ../shared/data, teacher-forced perplexity,
needle-in-a-haystack, and a per-layer capture of attention inputs. A paper's own analyses live beside its
reproduction scripts, in repro/<paper>/."""
