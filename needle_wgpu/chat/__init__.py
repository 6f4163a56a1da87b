"""How requests become token ids and completions become results, per model family."""
