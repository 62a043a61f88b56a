"""What aggregate statistics reveal, and what limits it: exposure tests, session ledger, DP noise."""
