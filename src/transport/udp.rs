//! UDP driver: placeholder replaced below.
