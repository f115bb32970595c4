//! The conformance suite against `MemDiscovery`, one fresh store per check.

use std::sync::Arc;

use oar_discovery::MemDiscovery;

oar_discovery::discovery_conformance!(Arc::new(MemDiscovery::new()));
