"""The sans-IO core: message matching, TITO planning, output parsing, records."""
