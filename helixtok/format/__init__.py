"""What a dataset is on disk, and nothing else: the manifest, shard files and sidecars, the bestfit
index, the plan file, the tokenizer file, where files live (local or fsspec URLs), and the typed errors.
Imports no other helixtok folder: every other folder imports it."""
