"""Other tools' formats: Megatron-LM's indexed dataset (export and import), llm.c's token file, HelixLM's
store, a Hugging Face datasets.Dataset (to_hf).  Imports format, read and (an import is a build) pipeline's output folder."""
