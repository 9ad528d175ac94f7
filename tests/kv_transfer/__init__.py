"""Tests for baton.kv_transfer."""
