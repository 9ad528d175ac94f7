"""Tests of the benchmark scripts under bench/."""
