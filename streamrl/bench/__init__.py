"""The benchmarks behind ``streamrl bench`` (`streamrl.bench.suite` runs them)."""
