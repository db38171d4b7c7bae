"""`apcscore compare`, the CI regression gate (docs/compare.md; its modules: docs/architecture.md). Kept empty so
`apcscore --help` stays fast."""
