//! The conformance suite on the FP32 reference backend.
conformance::conformance_suite!(conformance::ReferenceFactory::default());
