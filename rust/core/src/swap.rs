//! CPU swap-slot allocator: slots `0 .. cpu_offload_blocks` of the pinned CPU pool.
//!
//! A slot is either free (exactly once in the free stack, refcount 0) or held with
//! refcount = number of swapped-out request chunks referring to it (the scheduler only ever
//! uses refcount 1: each held slot belongs to one request chunk). Free + held = capacity.

/// Swap slot allocator.
#[derive(Clone, Debug)]
pub struct SwapPool {
    capacity: usize,
    free: Vec<u32>,
    refs: Vec<u32>,
}

impl SwapPool {
    pub fn new(capacity: usize) -> Self {
        SwapPool {
            capacity,
            free: (0..capacity as u32).rev().collect(),
            refs: vec![0; capacity],
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
    pub fn refcount(&self, slot: u32) -> u32 {
        self.refs[slot as usize]
    }
    /// Take a free slot (refcount 1).
    pub fn allocate(&mut self) -> Option<u32> {
        let s = self.free.pop()?;
        self.refs[s as usize] = 1;
        Some(s)
    }
    /// Take one more reference on a held slot.
    pub fn retain(&mut self, slot: u32) {
        debug_assert!(self.refs[slot as usize] > 0);
        self.refs[slot as usize] += 1;
    }
    /// Drop one reference; the slot is free again at zero.
    pub fn release(&mut self, slot: u32) {
        let r = &mut self.refs[slot as usize];
        debug_assert!(*r > 0);
        *r -= 1;
        if *r == 0 {
            self.free.push(slot);
        }
    }
    /// Check conservation given the slot references held by requests (with repetitions).
    pub fn check(&self, held: &[u32]) -> Result<(), String> {
        let mut count = vec![0u32; self.capacity];
        for &s in held {
            let i = s as usize;
            if i >= self.capacity {
                return Err(format!("swap slot {s} out of range"));
            }
            count[i] += 1;
        }
        let mut free = vec![false; self.capacity];
        for &s in &self.free {
            let i = s as usize;
            if i >= self.capacity || free[i] {
                return Err(format!(
                    "swap free list holds slot {s} twice or out of range"
                ));
            }
            free[i] = true;
        }
        for i in 0..self.capacity {
            if count[i] != self.refs[i] {
                return Err(format!(
                    "swap slot {i}: refcount {} but {} holders",
                    self.refs[i], count[i]
                ));
            }
            if free[i] == (count[i] > 0) {
                return Err(format!(
                    "swap slots not conserved: slot {i} free={} held={}",
                    free[i], count[i]
                ));
            }
        }
        Ok(())
    }
}
