//! CPU swap-slot allocator: slots `0 .. cpu_offload_blocks` of the pinned CPU pool.
//!
//! Invariant: every slot is either free (exactly once in the free stack) or held by exactly
//! one swapped-out request chunk; free + held = capacity.

/// Swap slot allocator.
#[derive(Clone, Debug)]
pub struct SwapPool {
    capacity: usize,
    free: Vec<u32>,
}

impl SwapPool {
    pub fn new(capacity: usize) -> Self {
        SwapPool {
            capacity,
            free: (0..capacity as u32).rev().collect(),
        }
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn free_slots(&self) -> &[u32] {
        &self.free
    }
    pub fn allocate(&mut self) -> Option<u32> {
        self.free.pop()
    }
    pub fn release(&mut self, slot: u32) {
        debug_assert!((slot as usize) < self.capacity);
        self.free.push(slot);
    }
    /// Check conservation given the slots held by requests.
    pub fn check(&self, held: &[u32]) -> Result<(), String> {
        let mut seen = vec![false; self.capacity];
        for &s in self.free.iter().chain(held) {
            let i = s as usize;
            if i >= self.capacity {
                return Err(format!("swap slot {s} out of range"));
            }
            if seen[i] {
                return Err(format!("swap slot {s} held twice"));
            }
            seen[i] = true;
        }
        if seen.iter().any(|s| !s) {
            return Err("swap slots not conserved: a slot is neither free nor held".into());
        }
        Ok(())
    }
}
