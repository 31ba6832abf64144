//! The UVM commands: initialization, external ranges and the mappings that hold memory.

use super::*;

impl Driver {
    pub(super) fn uvm_ioctl(&mut self, caller: Caller, fh: u64, cmd: u32, arg: u64) -> i32 {
        let size = match cmd {
            uvm::INITIALIZE => 16,
            uvm::MM_INITIALIZE => 8,
            uvm::CREATE_EXTERNAL_RANGE => 24,
            uvm::MAP_EXTERNAL_ALLOCATION => self.abi.uvm_map_external_size,
            uvm::ALLOC_SEMAPHORE_POOL => self.abi.uvm_semaphore_pool_size,
            uvm::FREE => self.abi.uvm_free_size,
            uvm::UNMAP_EXTERNAL => 40,
            _ => return EINVAL,
        };
        let Some(mut p) = read_mem(caller.tid, arg, size) else { return EFAULT };
        let status_at = match cmd {
            uvm::INITIALIZE => 8,
            uvm::MM_INITIALIZE => 4,
            uvm::CREATE_EXTERNAL_RANGE => 16,
            uvm::MAP_EXTERNAL_ALLOCATION => size - 4,
            uvm::UNMAP_EXTERNAL => 32,
            _ => size - 8,
        };
        let ready = self.files.get(&fh).is_some_and(|f| f.uvm_ready);
        let status = if cmd == uvm::INITIALIZE {
            if let Some(f) = self.files.get_mut(&fh) {
                f.uvm_ready = true;
            }
            status::OK
        } else if !ready {
            status::ILLEGAL_ACTION
        } else {
            self.uvm_command(caller, fh, cmd, &p).err().unwrap_or(status::OK)
        };
        put32(&mut p, status_at, status);
        if !write_mem(caller.tid, arg, &p) {
            return EFAULT;
        }
        0
    }

    fn uvm_command(&mut self, caller: Caller, fh: u64, cmd: u32, p: &[u8]) -> Result<(), u32> {
        let (base, length) = (get64(p, 0), get64(p, 8));
        match cmd {
            uvm::CREATE_EXTERNAL_RANGE => {
                let id = self.take(caller, (0, 0, 0), Kind::Virtual, 0, length, "uvm_create_external_range")?;
                self.add_range(fh, base, length, Some(id))
            }
            uvm::ALLOC_SEMAPHORE_POOL => {
                let id = self.take(caller, (0, 0, 0), Kind::System, 0, length, "uvm_alloc_semaphore_pool")?;
                self.add_range(fh, base, length, Some(id))
            }
            uvm::MAP_EXTERNAL_ALLOCATION => {
                let tail = p.len() - 16;
                let (client, memory) = (get32(p, tail + 4), get32(p, tail + 8));
                let id = self.clients.get(&client).and_then(|c| c.objects.get(&memory)).and_then(|o| o.memory);
                let id = id.ok_or(status::INVALID_OBJECT_HANDLE)?;
                let file = self.files.get_mut(&fh).ok_or(status::INVALID_ARGUMENT)?;
                file.maps.push((base, id));
                if let Some(m) = self.memory.get_mut(&id) {
                    m.handles += 1;
                }
                Ok(())
            }
            uvm::UNMAP_EXTERNAL => {
                // The mappings in [base, base + length) go; the range stays.
                let file = self.files.get_mut(&fh).ok_or(status::INVALID_ARGUMENT)?;
                let end = base.saturating_add(length);
                let (unmapped, kept): (Vec<_>, Vec<_>) = file.maps.drain(..).partition(|(b, _)| (base..end).contains(b));
                file.maps = kept;
                for (_, id) in unmapped {
                    self.drop_handle(caller, id, "unmapped");
                }
                Ok(())
            }
            uvm::FREE => {
                let file = self.files.get_mut(&fh).ok_or(status::INVALID_ARGUMENT)?;
                let range = file.ranges.remove(&base).ok_or(status::INVALID_ARGUMENT)?;
                // The range goes with every mapping in it.
                let end = base.saturating_add(range.0.max(1));
                let (unmapped, kept): (Vec<_>, Vec<_>) = file.maps.drain(..).partition(|(b, _)| (base..end).contains(b));
                file.maps = kept;
                for (_, id) in unmapped {
                    self.drop_handle(caller, id, "unmapped");
                }
                if let Some(id) = range.1 {
                    self.drop_handle(caller, id, "explicit");
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn add_range(&mut self, fh: u64, base: u64, length: u64, memory: Option<u64>) -> Result<(), u32> {
        let f = self.files.get_mut(&fh).ok_or(status::INVALID_ARGUMENT)?;
        if f.ranges.contains_key(&base) {
            return Err(status::UVM_ADDRESS_IN_USE);
        }
        f.ranges.insert(base, (length, memory));
        Ok(())
    }
}
