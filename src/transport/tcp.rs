//! TCP driver: placeholder replaced below.
