//! ferrobatch-core: every decision about KV memory and request order.
