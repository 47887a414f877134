"""Small models written in global shapes, used by the examples, the tests and the benchmarks."""
