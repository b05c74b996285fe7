"""Training the project's own tiny VLM target: synthetic grounded corpus, tokenizer, trainer.

No downloads: every image is drawn with Pillow from a seed, so the default model can be rebuilt
anywhere the toolkit installs.
"""
