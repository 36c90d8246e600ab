"""lm-eval tasks for Tandem (GSM8K test, generation and loglikelihood); see README.md."""
