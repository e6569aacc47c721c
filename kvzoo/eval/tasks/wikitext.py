"""The stock lm-eval `wikitext` task's detokenizer and per-document metrics, for kvzoo_wikitext.yaml."""

from lm_eval.tasks.wikitext.preprocess_wikitext import process_results, wikitext_detokenizer  # noqa: F401
