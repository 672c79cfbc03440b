//! CPU swap-slot allocator: slots `0 .. cpu_offload_blocks` of the pinned CPU pool.
//!
//! A slot is either free (exactly once in the free stack, refcount 0) or held with
//! refcount 1 by exactly one holder: a swapped-out request's chunk (`Request::swap_slots`),
//! or an outstanding plan (`kv::Held`) whose swap-in still reads it, or whose swap-out
//! still writes it for a request cancelled since. Held slots go back to the free stack when
//! that request is resumed or recomputed, or when that plan's update runs.
//! Free + held = capacity.

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
    /// Drop one reference; the slot is free again at zero.
    pub fn release(&mut self, slot: u32) {
        let r = &mut self.refs[slot as usize];
        debug_assert!(*r > 0);
        *r -= 1;
        if *r == 0 {
            self.free.push(slot);
        }
    }
    /// Check conservation given the slot references held by requests and outstanding plans
    /// (with repetitions).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_conserve_slots() {
        let mut p = SwapPool::new(3);
        assert_eq!((p.capacity(), p.num_free()), (3, 3));
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_eq!((a, b), (0, 1), "lowest slots first");
        assert_eq!(p.refcount(a), 1);
        p.check(&[a, b]).unwrap();
        assert!(p.check(&[a]).is_err(), "a held slot without holder");
        assert!(p.check(&[a, b, b]).is_err(), "refcount below holders");
        p.release(a);
        assert_eq!(p.refcount(a), 0);
        assert_eq!(p.num_free(), 2);
        assert_eq!(p.free_slots().last(), Some(&a));
        p.check(&[b]).unwrap();
        let c = p.allocate().unwrap();
        assert_eq!(c, a, "last released is reused first");
        let d = p.allocate().unwrap();
        assert!(p.allocate().is_none());
        p.check(&[b, c, d]).unwrap();
        assert!(p.check(&[b, c, d, 7]).is_err(), "out of range");
    }

    #[test]
    fn empty_pool() {
        let mut p = SwapPool::new(0);
        assert!(p.allocate().is_none());
        p.check(&[]).unwrap();
    }
}
