"""The build: corpus files -> work units -> worker processes (or Ray tasks) -> shard groups joined in place
-> published, manifest last; resume and merge.  Named pipeline, not build: `helixtok.build` is the public
function.  Imports format only."""
