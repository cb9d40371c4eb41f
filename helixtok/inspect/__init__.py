"""Looking at a finished dataset: verify, show, stats' summary, the HTML report, loader throughput.
Imports format, read and (to show where a document came from) pipeline's readers."""
